"""The ib check on the real H100 /sys/class/infiniband tree and on a simulated node.

Real input: tests/data/ibstat-sysfs/sys-class-infiniband_h100 (provenance in
tests/data/ibstat-sysfs/SOURCES.md): 8x ConnectX-7 NDR 400 InfiniBand ports,
all ACTIVE/LinkUp, mlx5_1 link_downed = 255, plus mlx5_bond_0, a BlueField-3
Ethernet (RoCE) port at 200 Gb/s. Simulated faults go through the real stack
(SimHarness from tests/conftest.py); time is stepped, never slept.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import SimHarness, run_on_json
from gpumon.check import CheckContext, KernelLog
from gpumon.checkstate import CheckStateStore
from gpumon.errors import HwCondition
from gpumon.hw import Hardware
from gpumon.hw.infiniband import PHYS_STATE_NAMES, parse_rate, parse_state
from gpumon.hw.inventory import Inventory
from gpumon.model import Action, Finding, Severity
from gpumon.profiles import GENERIC, Profile, builtin_profiles
from gpumon.sim import nvml_inject
from gpumon_checks.ib import IbCheck, IbConfig

TREE = Path(__file__).resolve().parents[1] / "data" / "ibstat-sysfs" / "sys-class-infiniband_h100"
NDR = ["mlx5_0", "mlx5_1", "mlx5_4", "mlx5_5", "mlx5_6", "mlx5_7", "mlx5_8", "mlx5_9"]
T0 = 1_800_000_000.0


@functools.cache
def _profiles() -> dict[str, Profile]:
    return builtin_profiles()


class Node:
    """A host root holding the real tree; runs the check at chosen times with its state
    kept as JSON between runs, as the daemon's store keeps it."""

    def __init__(self, root: Path, profile: str = "h100-sxm", options: IbConfig | None = None) -> None:
        self.root = root
        self.ib = root / "sys" / "class" / "infiniband"
        if not self.ib.exists():
            # hw_counters/ (RDMA transport counters) is not read by the check
            shutil.copytree(TREE, self.ib, ignore=shutil.ignore_patterns("hw_counters"))
        self.hw = Hardware(root)
        self.profile = GENERIC if profile == "generic" else _profiles()[profile]
        self.options = options or IbConfig()
        self.state: dict[str, Any] = {}
        self.set_boot("boot-1")

    def set_boot(self, boot_id: str) -> None:
        path = self.root / "proc" / "sys" / "kernel" / "random" / "boot_id"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(boot_id + "\n")

    def attr(self, dev: str, name: str) -> Path:
        return self.ib / dev / "ports" / "1" / name

    def write(self, dev: str, name: str, text: str) -> None:
        self.attr(dev, name).write_text(text)

    def down(self, dev: str) -> None:
        self.write(dev, "state", "1: DOWN\n")
        self.write(dev, "phys_state", "2: Polling\n")

    def up(self, dev: str) -> None:
        self.write(dev, "state", "4: ACTIVE\n")
        self.write(dev, "phys_state", "5: LinkUp\n")

    def run(self, t: float) -> dict[str, Finding]:
        ctx = CheckContext(hw=self.hw, inventory=Inventory(ib_devices=sorted(os.listdir(self.ib))),
                           profile=self.profile, options=self.options, state=self.state,
                           kernel_log=KernelLog(), clock=lambda: T0 + t)
        findings = run_on_json(IbCheck(), ctx)
        assert json.loads(json.dumps(self.state)) == self.state  # JSON types only (CheckStateStore)
        by = {f.component: f for f in findings}
        assert len(by) == len(findings), "one finding per component"
        return by


@pytest.fixture
def scratch(tmp_path: Path) -> Iterator[Path]:
    """A folder for host trees, on tmpfs when there is one: the tests rewrite sysfs files
    every simulated second, and a slow disk makes that the bulk of their run time."""
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK)):
        yield tmp_path
        return
    base = Path(tempfile.mkdtemp(dir=shm, prefix="gpumon-ib-"))
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def node(scratch: Path) -> Node:
    return Node(scratch)


def _sev(found: dict[str, Finding]) -> dict[str, str]:
    return {c: f.severity.value for c, f in found.items()}


# -- the real H100 tree ------------------------------------------------------------


def test_real_h100_tree_is_all_ok_against_h100_sxm(node: Node) -> None:
    node.run(0)
    found = node.run(1)
    assert set(found) == {f"ib/{d}/1" for d in [*NDR, "mlx5_bond_0"]} | {"node"}
    assert set(_sev(found).values()) == {"ok"}, {c: f.message for c, f in found.items()}
    count = found["node"]
    assert count.evidence["expected_ib_ports"] == 8
    assert count.evidence["infiniband_ports"] == [f"{d}/1" for d in NDR]
    assert count.evidence["active_infiniband_ports"] == 8
    assert count.evidence["other_rdma_ports"] == ["mlx5_bond_0/1"]
    for dev in NDR:
        ev = found[f"ib/{dev}/1"].evidence
        assert (ev["rate_gbps"], ev["expected_rate_gbps"], ev["link_layer"]) == (400.0, 400.0, "InfiniBand")
        assert (ev["downtime_s"], ev["outages"], ev["symbol_error_per_h"]) == (0.0, 0, 0.0)
    bond = found["ib/mlx5_bond_0/1"]
    assert bond.evidence["link_layer"] == "Ethernet" and "expected_rate_gbps" not in bond.evidence
    assert "not compared with the profile's InfiniBand rate" in bond.message


def test_saturated_link_downed_is_reported_not_warned(node: Node) -> None:
    node.run(0)
    mlx5_1 = node.run(1)["ib/mlx5_1/1"]
    assert mlx5_1.severity is Severity.OK
    assert mlx5_1.evidence["link_downed"] == 255
    assert mlx5_1.evidence["saturated_counters"] == ["link_downed"]
    assert "8-bit" in mlx5_1.evidence["link_downed_saturated_note"]
    assert "saturated" in mlx5_1.message
    # it stays blind to sub-sample outages, but a sampled outage is still timed
    node.down("mlx5_1")
    node.run(2)
    node.run(3)
    node.up("mlx5_1")
    after = node.run(4)["ib/mlx5_1/1"]
    assert after.evidence["outages"] == 1 and after.evidence["downtime_s"] == 2.0


@pytest.mark.parametrize(("profile", "node_severity", "expected"), [
    ("a100-sxm-80gb", "ok", 8),   # HDR 200 profile: 400 is not below it
    ("gb200", "ok", 4),           # more IB ports than a GB200 tray has: fine
    ("generic", "skipped", None),  # nothing to compare with: said, not ok
])
def test_real_tree_against_other_profiles(scratch: Path, profile: str, node_severity: str,
                                          expected: int | None) -> None:
    n = Node(scratch, profile)
    found = n.run(0)
    assert found["node"].severity.value == node_severity
    assert found["node"].evidence["expected_ib_ports"] == expected
    assert all(f.severity is Severity.OK for c, f in found.items() if c != "node")
    if profile == "generic":
        assert "no InfiniBand rate" in found["ib/mlx5_0/1"].evidence["profile_comparison"]


def test_missing_hca_is_a_missing_rail(node: Node) -> None:
    shutil.rmtree(node.ib / "mlx5_9")
    found = node.run(0)
    count = found["node"]
    assert (count.severity, count.action) == (Severity.FAIL, Action.INSPECT_HARDWARE)
    assert "7 InfiniBand ports" in count.message and "expects 8" in count.message
    assert "ib/mlx5_9/1" not in found


# -- downtime, link_downed, rates on the real tree -------------------------------


def test_outage_is_timed_between_samples(node: Node) -> None:
    for t in range(0, 5):
        node.run(t)
    node.down("mlx5_4")
    assert node.run(5)["ib/mlx5_4/1"].severity is Severity.WARN
    for t in range(6, 13):
        during = node.run(t)["ib/mlx5_4/1"]
    # down for exactly the timeout: not yet longer than it
    assert during.severity is Severity.WARN and during.evidence["ongoing_outage_s"] == 7.0
    node.up("mlx5_4")  # and no sample at 13
    after = node.run(14)["ib/mlx5_4/1"]
    assert (after.severity, after.action) == (Severity.FAIL, Action.CHECK_CABLES)
    assert after.evidence["longest_outage_s"] == 9.0 and after.evidence["downtime_s"] == 9.0
    # first down sample 5, last down 12 (a sample skipped at 13), first up 14: 9 s, at most 10 s
    assert after.evidence["recent_outages"][0]["at_most_s"] == 10.0


def test_link_downed_step_without_a_down_sample_is_an_outage(node: Node) -> None:
    node.run(0)
    node.write("mlx5_0", "counters/link_downed", "1\n")
    f = node.run(1)["ib/mlx5_0/1"]
    assert f.severity is Severity.OK
    ev = f.evidence
    assert (ev["outages"], ev["outages_seen_only_by_link_downed"], ev["downtime_s"]) == (1, 1, 0.0)
    assert ev["downtime_upper_bound_s"] == 1.0 and "between two samples" in ev["outages_by_link_downed_note"]


def test_first_reading_is_a_baseline(node: Node) -> None:
    node.write("mlx5_0", "counters/link_downed", "7\n")
    node.write("mlx5_0", "counters/symbol_error", "60000\n")
    ev = node.run(0)["ib/mlx5_0/1"].evidence
    assert (ev["outages"], ev["symbol_error_per_h"]) == (0, 0.0)


def test_counters_going_backwards_are_a_reset(node: Node) -> None:
    node.write("mlx5_0", "counters/symbol_error", "100\n")
    node.run(0)
    node.write("mlx5_0", "counters/symbol_error", "50\n")
    node.write("mlx5_1", "counters/link_downed", "0\n")  # cleared, e.g. perfquery -R
    found = node.run(10)  # error counters are read every 10 s
    ev = found["ib/mlx5_0/1"].evidence
    assert (ev["counter_resets"], ev["symbol_error_per_h"]) == (1, 0.0)
    assert found["ib/mlx5_1/1"].evidence["outages"] == 0
    node.write("mlx5_0", "counters/symbol_error", "60\n")
    ev = node.run(20)["ib/mlx5_0/1"].evidence
    assert ev["symbol_error_per_h"] == 10.0  # 10 new errors in the 1 h window
    assert all(v >= 0 for k, v in ev.items() if k.endswith("_per_h"))


def test_error_rates_warn(node: Node) -> None:
    node.run(0)
    node.write("mlx5_5", "counters/symbol_error", "121\n")
    node.write("mlx5_6", "counters/link_error_recovery", "200\n")
    found = node.run(60)
    sym = found["ib/mlx5_5/1"]
    assert (sym.severity, sym.action) == (Severity.WARN, Action.CHECK_CABLES)
    assert sym.evidence["symbol_error_per_h"] == 121.0 and "symbol_error" in sym.message
    assert found["ib/mlx5_6/1"].severity is Severity.OK  # 200/h is under 300/h
    # an hour later the burst has left the rate window
    assert node.run(60 + 3600 + 60)["ib/mlx5_5/1"].severity is Severity.OK


def test_link_retrained_at_a_lower_rate_warns_at_once(node: Node) -> None:
    node.run(0)
    node.run(1)
    node.down("mlx5_9")
    node.run(2)
    node.up("mlx5_9")
    node.write("mlx5_9", "rate", "200 Gb/sec (4X HDR)\n")
    f = node.run(3)["ib/mlx5_9/1"]  # back up: rate is read with the first up sample
    assert (f.severity, f.action) == (Severity.WARN, Action.CHECK_CABLES)
    assert f.evidence["rate"] == "200 Gb/sec (4X HDR)" and f.evidence["details_age_s"] == 0.0
    node.write("mlx5_8", "rate", "100 Gb/sec (4X EDR)\n")  # no outage seen: within 10 s
    assert node.run(4)["ib/mlx5_8/1"].severity is Severity.OK
    assert node.run(10)["ib/mlx5_8/1"].severity is Severity.WARN


def test_window_total_downtime_fails_without_any_long_outage(node: Node) -> None:
    node.run(0)
    t = 1
    for _ in range(6):  # six 6 s outages: none above 7 s, 36 s in total
        node.down("mlx5_7")
        for _ in range(6):
            node.run(t)
            t += 1
        node.up("mlx5_7")
        node.run(t)
        t += 1
    f = node.run(t)["ib/mlx5_7/1"]
    assert f.evidence["longest_outage_s"] == 6.0 and f.evidence["downtime_s"] == 36.0
    assert (f.severity, f.action) == (Severity.FAIL, Action.CHECK_CABLES) and "36.0 s down" in f.message


def test_port_down_from_the_first_reading_is_timed_and_fails(node: Node) -> None:
    """Issue 14 #8: a port down at boot (or at daemon start) is an outage from the first reading,
    failed past the same limits as one that went down while watched."""
    node.down("mlx5_8")
    node.write("mlx5_8", "phys_state", "3: Disabled\n")
    f = node.run(0)["ib/mlx5_8/1"]
    assert (f.severity, f.action) == (Severity.WARN, Action.CHECK_CABLES)
    assert "since gpumon first read it" in f.message and f.evidence["ongoing_outage_s"] == 0.0
    assert node.run(7)["ib/mlx5_8/1"].severity is Severity.WARN  # exactly the limit: not longer
    f = node.run(8)["ib/mlx5_8/1"]
    assert (f.severity, f.action) == (Severity.FAIL, Action.CHECK_CABLES)
    assert f.evidence["ongoing_outage_s"] == 8.0 and "at least" in f.evidence["ongoing_outage_note"]
    assert "down for 8.0 s now" in f.message
    f = node.run(100)["ib/mlx5_8/1"]
    assert (f.severity, f.evidence["outages"], f.evidence["downtime_s"]) == (Severity.FAIL, 1, 100.0)
    node.up("mlx5_8")
    f = node.run(101)["ib/mlx5_8/1"]  # back: the outage stays in the window
    assert (f.severity, f.action) == (Severity.FAIL, Action.CHECK_CABLES)
    assert f.evidence["longest_outage_s"] == 101.0
    assert f.evidence["recent_outages"][0]["seen_by"] == "state (down at first reading)"


def test_port_down_from_the_first_reading_keeps_its_start_across_a_restart(node: Node,
                                                                            tmp_path: Path) -> None:
    node.state = CheckStateStore(tmp_path / "state").get("ib")
    node.down("mlx5_8")
    node.run(0)
    node.run(1)  # no save by the daemon's timer: the state was saved when the outage opened
    node.state = CheckStateStore(tmp_path / "state").get("ib")  # a new process, same boot
    f = node.run(8)["ib/mlx5_8/1"]
    assert (f.severity, f.evidence["ongoing_outage_s"]) == (Severity.FAIL, 8.0)


def test_ignored_ports_are_neither_read_nor_counted(scratch: Path) -> None:
    n = Node(scratch, options=IbConfig(ignore_ports=["mlx5_8/1"]))
    n.down("mlx5_8")
    assert "ib/mlx5_8/1" not in n.run(0)
    found = n.run(60)
    assert "ib/mlx5_8/1" not in found and found["ib/mlx5_9/1"].severity is Severity.OK
    assert "mlx5_8/1" not in found["node"].evidence["infiniband_ports"]


def test_outage_records_are_capped(scratch: Path) -> None:
    n = Node(scratch)
    for dev in os.listdir(n.ib):
        if dev != "mlx5_0":
            shutil.rmtree(n.ib / dev)
    n.run(0)
    for t in range(1, 141):  # 140 sub-sample flaps, each seen only through link_downed
        n.write("mlx5_0", "counters/link_downed", f"{t}\n")
        found = n.run(t)
    assert found["ib/mlx5_0/1"].evidence["outages"] == 140
    assert len(n.state["ports"]["mlx5_0/1"]["outages"]) <= 128


# -- ports that disappear, garbage ----------------------------------------------


def test_hca_vanishing_at_runtime(node: Node) -> None:
    node.run(0)
    saved = node.root / "saved-mlx5_9"
    shutil.move(node.ib / "mlx5_9", saved)
    found = node.run(1)
    port, count = found["ib/mlx5_9/1"], found["node"]
    assert (port.severity, port.action) == (Severity.WARN, Action.REBOOT_NODE)
    assert "disappeared" in port.message
    assert (count.severity, count.action) == (Severity.FAIL, Action.REBOOT_NODE)
    assert count.evidence["vanished_ports"] == ["mlx5_9/1"]
    assert node.run(9)["ib/mlx5_9/1"].severity is Severity.FAIL
    shutil.move(saved, node.ib / "mlx5_9")
    back = node.run(10)
    assert back["node"].severity is Severity.OK
    assert back["ib/mlx5_9/1"].evidence["longest_outage_s"] == 9.0
    assert back["ib/mlx5_9/1"].severity is Severity.FAIL


def test_port_folder_disappearing(node: Node) -> None:
    node.run(0)
    shutil.rmtree(node.ib / "mlx5_6" / "ports" / "1")
    found = node.run(1)
    port, count = found["ib/mlx5_6/1"], found["node"]
    assert (port.severity, port.action) == (Severity.WARN, Action.REBOOT_NODE)
    assert count.severity is Severity.FAIL and "mlx5_6 is in /sys/class/infiniband but shows no ports" in \
        count.message and count.evidence["vanished_ports"] == ["mlx5_6/1"]


def test_a_vanished_port_relists_the_devices_after_it_at_once(node: Node) -> None:
    # what reading one device at a time did: the devices from the vanished one on are
    # listed again before their ports are read, so a port that appeared there counts now;
    # a port that appeared on an earlier device waits for the next listing (every 10 s)
    node.run(0)
    shutil.rmtree(node.ib / "mlx5_6" / "ports" / "1")
    for dev in ("mlx5_4", "mlx5_8"):
        shutil.copytree(node.ib / dev / "ports" / "1", node.ib / dev / "ports" / "2")
    found = node.run(1)
    assert "ib/mlx5_8/2" in found and "ib/mlx5_4/2" not in found
    assert found["ib/mlx5_8/2"].severity is Severity.OK
    assert found["node"].evidence["vanished_ports"] == ["mlx5_6/1"]
    assert "mlx5_6 is in /sys/class/infiniband but shows no ports" in found["node"].message
    assert "ib/mlx5_4/2" in node.run(10)


def test_a_hung_read_fails_its_port_only_and_the_next_run_is_not_held_up(node: Node) -> None:
    node.run(0)
    node.hw = Hardware(node.root, fs_timeout=0.3)
    stuck = node.attr("mlx5_6", "state")
    stuck.unlink()
    os.mkfifo(stuck)  # nobody writes: the read blocks, as a sysfs read behind a dead HCA can
    try:
        found = node.run(1)
        hung_in = "hung after 0.3 s in read(sys/class/infiniband/mlx5_6/ports/1/state)"
        port = found["ib/mlx5_6/1"]
        assert (port.severity, port.message) == (Severity.FAIL, hung_in)
        # the ports read after it are read on another worker: only the stuck file is lost
        for dev in ("mlx5_0", "mlx5_1", "mlx5_4", "mlx5_5", "mlx5_7", "mlx5_8", "mlx5_9", "mlx5_bond_0"):
            assert found[f"ib/{dev}/1"].severity is Severity.OK, found[f"ib/{dev}/1"].message
        # while the read stays stuck, the next run waits for nothing: that file is refused at once
        start = time.monotonic()
        again = node.run(2)
        assert time.monotonic() - start < 0.25
        assert (again["ib/mlx5_6/1"].severity, again["ib/mlx5_6/1"].message) == (Severity.FAIL, hung_in)
    finally:
        with contextlib.suppress(OSError):  # ENXIO: no reader waits
            os.close(os.open(stuck, os.O_WRONLY | os.O_NONBLOCK))  # let the worker go


def test_garbage_state_and_rate_are_unknown_for_that_port(node: Node) -> None:
    node.run(0)
    node.write("mlx5_4", "state", "4: ACT\x00")
    node.write("mlx5_5", "rate", "fast\n")
    node.write("mlx5_6", "counters/symbol_error", "-3\n")
    found = node.run(10)  # rate and error counters are read every 10 s, state every second
    assert found["ib/mlx5_4/1"].severity is Severity.UNKNOWN and "state" in found["ib/mlx5_4/1"].message
    assert found["ib/mlx5_5/1"].severity is Severity.UNKNOWN and "rate" in found["ib/mlx5_5/1"].message
    assert found["ib/mlx5_6/1"].severity is Severity.UNKNOWN
    assert "symbol_error" in found["ib/mlx5_6/1"].message
    others = {c: s for c, s in _sev(found).items()
              if c not in ("ib/mlx5_4/1", "ib/mlx5_5/1", "ib/mlx5_6/1", "node")}
    assert set(others.values()) == {"ok"}
    # a port whose state cannot be read may or may not be there: the count is not confirmed
    assert found["node"].severity is Severity.UNKNOWN and "1 unreadable (mlx5_4/1)" in found["node"].message


def test_unlistable_device_is_unknown_not_gone(node: Node) -> None:
    node.run(0)
    (node.ib / "mlx5_7" / "ports" / "x").mkdir()
    found = node.run(10)  # port folders are listed every 10 s
    port, count = found["ib/mlx5_7/1"], found["node"]
    assert port.severity is Severity.UNKNOWN and "port folder name" in port.message
    assert count.severity is Severity.UNKNOWN and "cannot list ports" in count.message
    assert "vanished_ports" not in count.evidence


def test_wall_clock_stepping_back_makes_no_negative_outage(node: Node) -> None:
    node.run(100)
    node.down("mlx5_8")
    node.run(101)
    node.up("mlx5_8")
    node.write("mlx5_8", "counters/link_downed", "3\n")
    ev = node.run(90)["ib/mlx5_8/1"].evidence  # NTP stepped the clock back 11 s
    assert ev["downtime_s"] >= 0 and ev["downtime_upper_bound_s"] >= 0 and ev["longest_outage_s"] >= 0
    assert all(r["down_s"] >= 0 and r["at_most_s"] >= 0 for r in ev["recent_outages"])


@pytest.fixture(scope="module")
def garbage_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("garbage")
    shutil.copytree(TREE / "mlx5_0", root / "sys" / "class" / "infiniband" / "mlx5_0",
                    ignore=shutil.ignore_patterns("hw_counters"))
    return root


def _rejects(parse: Any, text: str) -> bool:
    try:
        parse(text)
    except HwCondition:
        return True
    return False


@settings(max_examples=60)
@given(attr=st.sampled_from(["state", "phys_state", "rate"]), text=st.text(max_size=40))
def test_any_text_in_state_or_rate_never_crashes_nor_passes(garbage_root: Path, attr: str, text: str) -> None:
    n = Node(garbage_root)
    n.run(0)
    path = n.attr("mlx5_0", attr)
    original = path.read_bytes()
    try:
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
        f = n.run(10)["ib/mlx5_0/1"]  # a full read: rate is read every 10 s
    finally:
        path.write_bytes(original)
    parse = {"state": parse_state, "phys_state": lambda s: parse_state(s, names=PHYS_STATE_NAMES),
             "rate": parse_rate}[attr]
    stripped = text.encode("utf-8", errors="replace").decode("utf-8").strip()
    if _rejects(parse, stripped):
        assert f.severity is Severity.UNKNOWN, f
    else:
        assert f.severity is not Severity.UNKNOWN


# -- state: restarts, reboots, bad state --------------------------------------------


def test_state_survives_a_daemon_restart(node: Node, tmp_path: Path) -> None:
    store = CheckStateStore(tmp_path / "state")
    node.state = store.get("ib")
    node.run(0)
    node.down("mlx5_8")
    node.run(1)
    node.run(2)
    assert store.save("ib")
    restarted = CheckStateStore(tmp_path / "state")
    node.state = restarted.get("ib")
    node.run(3)
    node.up("mlx5_8")
    ev = node.run(4)["ib/mlx5_8/1"].evidence
    assert (ev["outages"], ev["downtime_s"]) == (1, 3.0)


def test_one_damaged_port_record_costs_only_that_port(node: Node, tmp_path: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """A hand edit or damage in one port's saved record forgets that port only: an outage open on
    another port keeps its start across the restart."""
    store = CheckStateStore(tmp_path / "state")
    node.state = store.get("ib")
    node.run(0)
    node.down("mlx5_8")
    node.run(1)
    node.run(2)
    assert store.save("ib")
    path = tmp_path / "state" / "ib.json"
    saved = json.loads(path.read_text())
    saved["ports"]["mlx5_0/1"]["last_up"] = "yes"
    path.write_text(json.dumps(saved))
    node.state = CheckStateStore(tmp_path / "state").get("ib")
    with caplog.at_level(logging.WARNING, logger="gpumon"):
        node.run(3)
    assert "port mlx5_0/1 forgotten" in caplog.text and "refused" not in caplog.text
    node.up("mlx5_8")
    ev = node.run(4)["ib/mlx5_8/1"].evidence
    assert (ev["outages"], ev["downtime_s"]) == (1, 3.0)


def test_an_outage_start_is_on_disk_the_moment_it_is_seen(node: Node, tmp_path: Path) -> None:
    """Issue 14 #1: the daemon saves check state at most every 10 s; the sample that sees a port
    go down (or come back) saves it at once, so a kill -9 right after loses nothing."""
    store = CheckStateStore(tmp_path / "state")
    node.state = store.get("ib")
    node.run(0)
    assert store.save("ib")  # the daemon's timed save, port up
    node.down("mlx5_8")
    node.run(1)
    on_disk = json.loads((tmp_path / "state" / "ib.json").read_text())
    assert on_disk["ports"]["mlx5_8/1"]["down_since"] == T0 + 1
    node.run(2)
    node.run(3)
    # killed here, no save since the one at t=1; restarted on the same state dir, same boot
    at_crash = (tmp_path / "state" / "ib.json").read_text()
    for still_down, back_at in ((True, 11.0), (False, 12.0)):
        (tmp_path / "state" / "ib.json").write_text(at_crash)
        node.down("mlx5_8")
        node.state = CheckStateStore(tmp_path / "state").get("ib")
        if still_down:
            # the port is still down: the outage goes on from its saved start
            f = node.run(5)["ib/mlx5_8/1"]
            assert (f.severity, f.evidence["ongoing_outage_s"]) == (Severity.WARN, 4.0)
            node.up("mlx5_8")
            f = node.run(back_at)["ib/mlx5_8/1"]
            assert f.evidence["longest_outage_s"] == 10.0
        else:
            # the port came back while gpumon was not running: counted up to the first reading
            # after the restart, the one that sees it up (gpumon cannot know it was shorter)
            node.up("mlx5_8")
            f = node.run(back_at)["ib/mlx5_8/1"]
            assert f.evidence["longest_outage_s"] == 11.0
        assert (f.severity, f.action) == (Severity.FAIL, Action.CHECK_CABLES)
        assert (f.evidence["outages"], f.evidence["recent_outages"][0]["start"]) == (1, T0 + 1)
        # the closed outage is on disk too, before any timed save
        on_disk = json.loads((tmp_path / "state" / "ib.json").read_text())
        assert on_disk["ports"]["mlx5_8/1"]["down_since"] is None
        assert on_disk["ports"]["mlx5_8/1"]["outages"][0]["end"] == T0 + back_at


def test_reboot_closes_an_open_outage_and_rebaselines_counters(node: Node) -> None:
    node.run(0)
    node.down("mlx5_8")
    node.run(1)
    node.run(2)
    node.set_boot("boot-2")
    node.up("mlx5_8")
    node.write("mlx5_8", "counters/link_downed", "0\n")
    ev = node.run(300)["ib/mlx5_8/1"].evidence
    assert ev["outages"] == 1 and ev["downtime_s"] == 1.0  # closed at the last sample that saw it down
    assert ev["counter_resets"] == 0  # a new boot is a new baseline, not a reset


def test_state_of_another_shape_starts_afresh(node: Node) -> None:
    node.state.update({"version": 1, "boot_id": "boot-1",
                       "ports": {"mlx5_0/1": {"junk": 1}, "../x": 5, "mlx5_1/1": None}})
    found = node.run(0)
    assert set(_sev(found).values()) == {"ok"}
    for bad in ({"version": "x"}, {"version": 1, "ports": {}}, {"version": 1, "boot_id": 3, "ports": {}}):
        node.state = dict(bad)
        assert set(_sev(node.run(1)).values()) == {"ok"}
    good = node.state["ports"]["mlx5_0/1"]
    node.state["ports"]["mlx5_0/1"] = {**good, "last_up": "yes", "resets": 1.5}
    assert set(_sev(node.run(2)).values()) == {"ok"}


def test_capability_gate_and_ignored_devices(scratch: Path) -> None:
    assert IbCheck().supported(Inventory()) == "no InfiniBand/RDMA devices in /sys/class/infiniband"
    assert IbCheck().supported(Inventory(ib_devices=["mlx5_0"])) is None
    n = Node(scratch, options=IbConfig(ignore_devices=["mlx5_bond_0", "mlx5_9"]))
    found = n.run(0)
    assert "ib/mlx5_bond_0/1" not in found and "ib/mlx5_9/1" not in found
    assert found["node"].severity is Severity.FAIL  # the profile still wants 8 InfiniBand ports
    with pytest.raises(ValueError):
        IbConfig(rate_window_s=7200, window_s=3600)


def test_every_default_threshold_has_a_source() -> None:
    import dataclasses
    for f in dataclasses.fields(IbConfig):
        if f.type in ("float", float):
            assert len(f.metadata.get("source", "")) > 20, f.name


# -- simulated node through the real stack -------------------------------------------


@pytest.fixture
def fast_sim(inject_lib_dir: Path, tmp_path: Path, scratch: Path,
             monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The `sim` fixture's harness (tests/conftest.py) on the scratch folder: these tests
    render the whole node every simulated second (~640 files), ~0.75 s a step on a slow
    disk and ~0.1 s on tmpfs."""
    monkeypatch.setenv(nvml_inject.STATE_ENV, str(tmp_path / "unset"))
    made: list[SimHarness] = []

    def make(scenario: str) -> SimHarness:
        h = SimHarness(scenario, scratch / f"sim{len(made)}", inject_lib_dir)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


FAULTS = """
name: ib-faults
sku: h100-sxm
faults:
  - {at_s: 60, kind: ib_down, device: mlx5_2, port: 1, duration_s: 9}
  - {at_s: 60, kind: ib_down, device: mlx5_3, port: 1, duration_s: 3}
  - {at_s: 62.5, kind: ib_errors, device: mlx5_4, counter: link_downed, count: 1}
  - {at_s: 64.3, kind: ib_down, device: mlx5_7, port: 1, duration_s: 0.4}
  - {at_s: 60, kind: ib_rate, device: mlx5_5, rate_gbps: 200}
  - {at_s: 60, kind: ib_errors, device: mlx5_6, counter: symbol_error, per_s: 20, duration_s: 12}
"""


def test_simulated_faults_sampled_every_second(fast_sim: Any) -> None:
    h = fast_sim(FAULTS)
    seen: dict[int, dict[str, Finding]] = {}
    for t in range(55, 77):
        seen[t] = {f.component: f for f in h.run(IbCheck, t=t)}
    assert set(_sev(seen[59]).values()) == {"ok"}
    assert seen[62]["ib/mlx5_2/1"].severity is Severity.WARN  # down 2 s so far
    assert seen[68]["ib/mlx5_2/1"].severity is Severity.FAIL  # still down, past the 7 s timeout
    end = seen[76]
    # the 9 s outage: fail, downtime and longest outage within 1 s of 9 s
    down9 = end["ib/mlx5_2/1"]
    assert (down9.severity, down9.action) == (Severity.FAIL, Action.CHECK_CABLES)
    assert abs(down9.evidence["downtime_s"] - 9) <= 1 and abs(down9.evidence["longest_outage_s"] - 9) <= 1
    assert down9.evidence["outages"] == 1
    # the 3 s outage: counted as downtime, not a fail
    down3 = end["ib/mlx5_3/1"]
    assert down3.severity is Severity.OK and abs(down3.evidence["downtime_s"] - 3) <= 1
    assert down3.evidence["outages"] == 1
    # link_downed stepped while the port stayed ACTIVE: counted, duration bounded by the 1 s interval
    for comp in ("ib/mlx5_4/1", "ib/mlx5_7/1"):
        ev = end[comp].evidence
        assert end[comp].severity is Severity.OK
        assert (ev["outages"], ev["outages_seen_only_by_link_downed"], ev["downtime_s"]) == (1, 1, 0.0)
        assert ev["downtime_upper_bound_s"] <= 1.0
    # NDR port trained at 200: a warn within 10 s (rate is read every 10 s, state every second)
    assert seen[59]["ib/mlx5_5/1"].severity is Severity.OK
    assert seen[70]["ib/mlx5_5/1"].severity is Severity.WARN
    rate = end["ib/mlx5_5/1"]
    assert (rate.severity, rate.action) == (Severity.WARN, Action.CHECK_CABLES)
    assert rate.evidence["rate_gbps"] == 200 and "expects 400 Gb/s" in rate.message
    # symbol_error ramp of 20/s for 12 s: 240 in the hour
    sym = end["ib/mlx5_6/1"]
    assert (sym.severity, sym.action) == (Severity.WARN, Action.CHECK_CABLES)
    assert sym.evidence["symbol_error_per_h"] == 240.0
    assert {c: s for c, s in _sev(end).items() if c in ("ib/mlx5_0/1", "ib/mlx5_1/1", "node")} == {
        "ib/mlx5_0/1": "ok", "ib/mlx5_1/1": "ok", "node": "ok"}
    # a day later every outage has left the 24 h window
    later = {f.component: f for f in h.run(IbCheck, t=69 + 86400 + 1)}
    for comp in ("ib/mlx5_2/1", "ib/mlx5_3/1", "ib/mlx5_4/1", "ib/mlx5_7/1"):
        assert later[comp].severity is Severity.OK and later[comp].evidence["outages"] == 0, comp


def test_simulated_node_missing_an_hca_and_one_without_rdma(fast_sim: Any) -> None:
    h = fast_sim("name: seven\nsku: h100-sxm\nib_devices: 7\n")
    found = {f.component: f for f in h.run(IbCheck, t=1)}
    assert (found["node"].severity, found["node"].action) == (Severity.FAIL, Action.INSPECT_HARDWARE)
    none = fast_sim("name: none\nsku: h100-sxm\nib_devices: 0\n")
    inventory = none.context(IbCheck, t=1).inventory
    assert IbCheck().supported(inventory) == "no InfiniBand/RDMA devices in /sys/class/infiniband"


# -- a steady port's finding is kept between samples ---------------------------------


def _run_kept(node: Node, t: float, state: dict[str, Any], check: IbCheck) -> list[Finding]:
    """One sample as the daemon takes it: ``check`` is kept from run to run (the daemon builds its
    checks once), or a new one for a sample without what the check keeps between runs."""
    ctx = CheckContext(hw=node.hw, inventory=Inventory(ib_devices=sorted(os.listdir(node.ib))),
                       profile=node.profile, options=node.options, state=state, kernel_log=KernelLog(),
                       clock=lambda: T0 + t)
    return run_on_json(check, ctx)


def _as_text(findings: list[Finding]) -> list[str]:
    return [json.dumps(f.to_json()) for f in findings]  # key order included


class _Twins:
    """The same node sampled twice at each time: with the kept findings (one check instance from
    run to run, as the daemon's runner does) and without (a new instance, as the tests above)."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.kept_state: dict[str, Any] = {}
        self.fresh_state: dict[str, Any] = {}
        self.check = IbCheck()

    def run(self, t: float) -> list[Finding]:
        kept = _run_kept(self.node, t, self.kept_state, self.check)
        fresh = _run_kept(self.node, t, self.fresh_state, IbCheck())
        assert _as_text(kept) == _as_text(fresh), t
        assert self.kept_state == self.fresh_state
        return kept


def test_a_steady_port_gets_the_finding_a_full_verdict_gives(node: Node) -> None:
    twins = _Twins(node)
    for t in range(0, 25):  # two detail reads (every 10 s): details_age_s goes 0..9 twice
        found = {f.component: f for f in twins.run(t)}
        assert found["ib/mlx5_0/1"].evidence["details_age_s"] == float(t % 10)
    assert len(twins.check._steady) == len(NDR) + 1  # every up port (one is RoCE)
    # what changes a steady port's finding is seen at once
    node.write("mlx5_8", "rate", "100 Gb/sec (4X EDR)\n")
    assert {f.component: f for f in twins.run(30)}["ib/mlx5_8/1"].severity is Severity.WARN
    node.write("mlx5_0", "counters/symbol_error", "5\n")  # now in the rate window
    node.write("mlx5_1", "counters/port_rcv_errors", "3\n")  # in the evidence only
    node.write("mlx5_4", "counters/link_downed", "255\n")  # saturated, and an outage counted
    for t in range(40, 43):
        found = {f.component: f for f in twins.run(t)}
    assert found["ib/mlx5_0/1"].evidence["symbol_error_per_h"] == 5.0
    assert found["ib/mlx5_1/1"].evidence["port_rcv_errors"] == 3
    assert found["ib/mlx5_4/1"].evidence["saturated_counters"] == ["link_downed"]
    node.write("mlx5_1", "counters/port_rcv_errors", "4\n")  # up by one: only the counter changes
    assert {f.component: f for f in twins.run(50)}["ib/mlx5_1/1"].evidence["port_rcv_errors"] == 4
    # an hour later the symbol errors have left the rate window, nothing else changed
    assert {f.component: f for f in twins.run(40 + 3600 + 60)}["ib/mlx5_0/1"].evidence[
        "symbol_error_per_h"] == 0.0
    # a reset counted while the port was down, the counter back where it was, and a day
    # later (the outage out of the window) the port steady again: the reset is still said
    resets = found["ib/mlx5_1/1"].evidence["counter_resets"]
    t = 40 + 3600 + 61
    twins.run(t)
    node.down("mlx5_1")
    node.write("mlx5_1", "counters/port_rcv_errors", "2\n")
    twins.run(t + 1)
    twins.run(t + 2)  # a port not up at the last sample is read in full
    node.up("mlx5_1")
    node.write("mlx5_1", "counters/port_rcv_errors", "4\n")
    twins.run(t + 3)
    again = {f.component: f for f in twins.run(t + 3 + 86400 + 1)}["ib/mlx5_1/1"]
    assert (again.evidence["outages"], again.evidence["counter_resets"]) == (0, resets + 1)
    # a kept finding is not the one handed out before: nothing is shared between two samples
    a, b = twins.run(51), twins.run(52)
    for x, y in zip(a, b, strict=True):
        assert x.evidence is not y.evidence
        assert x.evidence.get("readings") is not y.evidence.get("readings") or not x.evidence.get("readings")


_ACTION = st.sampled_from(["none", "down", "up", "counter", "rate", "garbage", "missing"])


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([0.5, 1.0, 1.0, 1.0, 4.0, 11.0, 3700.0, 86500.0]), _ACTION,
                          st.sampled_from(NDR[:3]),
                          st.sampled_from(["symbol_error", "link_error_recovery", "link_downed",
                                           "port_rcv_errors"]),
                          st.integers(0, 300)), min_size=1, max_size=30))
def test_kept_findings_are_what_full_verdicts_give_whatever_happens(
        steps: list[tuple[float, str, str, str, int]]) -> None:
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else None
    with tempfile.TemporaryDirectory(dir=base, prefix="gpumon-ib-") as d:
        node = Node(Path(d))
        twins = _Twins(node)
        t = 0.0
        twins.run(t)
        for dt, action, dev, counter, value in steps:
            if action == "down":
                node.down(dev)
            elif action == "up":
                node.up(dev)
            elif action == "counter":
                node.write(dev, f"counters/{counter}", f"{value}\n")
            elif action == "rate":
                node.write(dev, "rate", "400 Gb/sec (4X NDR)\n" if value % 2 else "200 Gb/sec (4X HDR)\n")
            elif action == "garbage":
                node.write(dev, f"counters/{counter}", "not a number\n")
            elif action == "missing":
                with contextlib.suppress(FileNotFoundError):
                    node.attr(dev, f"counters/{counter}").unlink()
            t += dt
            twins.run(t)
