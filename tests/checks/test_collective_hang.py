"""The collective_hang check on a simulated node stepped through scenario time (10 s samples, as the
daemon runs it): the NVML injection library serves utilization, memory activity, power, PCIe
throughput and compute processes to the real nvidia-ml-py; the check's clock is the scenario's, so no
test waits the 60 s it judges."""

from __future__ import annotations

import json
from typing import Any

import pytest
from prometheus_client import generate_latest

from conftest import run_on_json
from gpumon.check import CheckContext
from gpumon.export.prometheus import Snapshot, SnapshotHolder, make_registry
from gpumon.model import CheckRun, Finding, Severity
from gpumon_checks.collective_hang import CollectiveHangCheck, CollectiveHangConfig, Run

# what NCCL waiting for a peer that never comes looks like to NVML on an H100 SXM: a resident
# polling kernel (100 % utilized), little over idle power, no memory or PCIe traffic
HUNG = "kind: activity, pct: 100, memory_pct: 0, power_w: 118, pcie_mbps: 0.5"
TRAINING = "kind: activity, pct: 100, memory_pct: 62, power_w: 640, pcie_mbps: 2100"


class _Daemon:
    """One check instance, one state, a clock that is the scenario's time (the daemon's way)."""

    def __init__(self, h: Any) -> None:
        self.h = h
        self.t = 0.0
        self.check = CollectiveHangCheck()
        self.ctx: CheckContext = h.context(CollectiveHangCheck, 0.0)
        self.ctx.clock = lambda: h.node.start_wall + self.t

    def step(self, t: float) -> dict[str, Finding]:
        self.h.render(t)
        self.t = t
        findings = run_on_json(self.check, self.ctx)
        state = self.h.states["collective_hang"]
        assert json.loads(json.dumps(state)) == state  # JSON types only (CheckStateStore)
        return {f.component: f for f in findings}

    def walk(self, until: float, every: float = 10.0) -> list[dict[str, Finding]]:
        return [self.step(k * every) for k in range(int(until // every) + 1)]


def _scenario(*faults: str, gpus: int = 4) -> str:
    return (f"name: t\nsku: h100-sxm\ngpus: {gpus}\nfaults:\n"
            + "".join(f"  - {{{f}}}\n" for f in faults))


def _readings(f: Finding) -> dict[str, float]:
    return {name: value for name, value, _ in f.evidence["readings"]}


def test_the_signature_held_60_s_is_a_warning_with_its_words_and_metric(sim: Any) -> None:
    h = sim(_scenario(f"at_s: 0, gpu: 0, {HUNG}",
                      "at_s: 0, kind: compute_process, gpu: 0, pid: 4242, memory_mib: 70000",
                      "at_s: 0, kind: compute_process, gpu: 0, pid: 4243"))
    d = _Daemon(h)
    steps = d.walk(60)
    for t, found in zip(range(0, 60, 10), steps[:-1], strict=True):
        early = found["gpu/0"]
        assert early.severity is Severity.OK and early.evidence["activity"] == "signature", t
        assert early.evidence["held_s"] == t and _readings(early) == {
            "gpu_collective_hang": 0.0, "gpu_collective_hang_seconds": float(t)}
    stuck = steps[-1]["gpu/0"]
    assert (stuck.severity, stuck.action.value) == (Severity.WARN, "none")
    assert stuck.message == ("GPU 0 looks stuck in a collective: util 100 %, power 118 W, memory 0 %, "
                             "PCIe 0.5 MB/s for 60 s, process(es) 4242, 4243")
    ev = stuck.evidence
    assert ev["activity"] == "stuck" and ev["since"] == h.node.start_wall
    assert ev["since_utc"] == "2027-01-15T08:00:00Z" and ev["held_s"] == 60
    assert (ev["pcie_tx_mbps"], ev["pcie_rx_mbps"], ev["compute_pids"]) == (0.5, 0.5, [4242, 4243])
    assert ev["thresholds"]["max_power_w"] == 160  # the h100-sxm profile's number (sichek's H100 SXM)
    # the quiet GPUs of the same node: no signature, nothing held
    for comp in ("gpu/1", "gpu/2", "gpu/3"):
        assert steps[-1][comp].severity is Severity.OK
        assert _readings(steps[-1][comp]) == {"gpu_collective_hang": 0.0, "gpu_collective_hang_seconds": 0.0}
    # on /metrics: a 0/1 gauge and the seconds, per GPU
    snap = Snapshot("n", "p", "v", {"collective_hang": CheckRun(
        "collective_hang", list(steps[-1].values()), 0.0, 1.0, "completed")})
    text = generate_latest(make_registry(SnapshotHolder(snap))).decode()
    assert 'gpumon_gpu_collective_hang{check="collective_hang",component="gpu/0"} 1.0' in text
    assert 'gpumon_gpu_collective_hang_seconds{check="collective_hang",component="gpu/0"} 60.0' in text
    assert 'gpumon_gpu_collective_hang{check="collective_hang",component="gpu/1"} 0.0' in text


def test_idle_full_load_and_no_process_are_not_hung(sim: Any) -> None:
    """The traps: a GPU with a process but idle (util 0), one at full load (power and memory high),
    and the signature's numbers on a GPU no process holds."""
    h = sim(_scenario("at_s: 0, kind: compute_process, gpu: 0, pid: 100",          # idle, process
                      f"at_s: 0, gpu: 1, {TRAINING}",
                      "at_s: 0, kind: compute_process, gpu: 1, pid: 101",
                      f"at_s: 0, gpu: 2, {HUNG}",                                      # no process
                      "at_s: 0, kind: activity, gpu: 3, pct: 100, memory_pct: 1, power_w: 120, "
                      "pcie_mbps: 900",                                                 # host traffic
                      "at_s: 0, kind: compute_process, gpu: 3, pid: 103"))
    for found in _Daemon(h).walk(120):
        assert {f.severity for f in found.values()} == {Severity.OK}
        assert all(_readings(f)["gpu_collective_hang_seconds"] == 0 for f in found.values())
    idle, busy, orphan, copying = (found[f"gpu/{i}"] for i in range(4))
    assert idle.evidence["activity"] == "idle" and "util 0 %" in idle.message
    assert busy.evidence["activity"] == "working"
    assert "power 640 W (signature < 160 W)" in busy.message and "memory 62 %" in busy.message
    assert "pcie_tx_mbps" not in busy.evidence  # broken already: PCIe not sampled (2 x 20 ms saved)
    assert orphan.evidence["activity"] == "no_process" and "no compute process" in orphan.message
    assert copying.evidence["activity"] == "working" and "PCIe TX 900 MB/s" in copying.message


def test_a_40_s_pause_then_recovery_is_not_hung(sim: Any) -> None:
    h = sim(_scenario(f"at_s: 0, gpu: 0, {TRAINING}",
                      f"at_s: 20, duration_s: 40, gpu: 0, {HUNG}",   # later in the list: wins while on
                      "at_s: 0, kind: compute_process, gpu: 0, pid: 7", gpus=1))
    held = []
    for found in _Daemon(h).walk(150):
        f = found["gpu/0"]
        assert f.severity is Severity.OK, f.message
        held.append(_readings(f)["gpu_collective_hang_seconds"])
    # samples at 20, 30, 40, 50 show it (held 0..30 s), 60 is training again
    assert held[:8] == [0, 0, 0, 10, 20, 30, 0, 0]
    assert max(held) == 30


def test_one_sample_without_the_signature_starts_the_duration_again(sim: Any) -> None:
    h = sim(_scenario(f"at_s: 0, gpu: 0, {HUNG}",
                      f"at_s: 50, duration_s: 5, gpu: 0, {TRAINING}",   # only the 50 s sample breaks
                      "at_s: 0, kind: compute_process, gpu: 0, pid: 7", gpus=1))
    steps = _Daemon(h).walk(120)
    held = [_readings(s["gpu/0"])["gpu_collective_hang_seconds"] for s in steps]
    assert held == [0, 10, 20, 30, 40, 0, 0, 10, 20, 30, 40, 50, 60]
    severities = [s["gpu/0"].severity for s in steps]
    # 40 s before the break and 50 s after it were never 60 s in one piece: stuck only at 120 s
    assert severities == [Severity.OK] * 12 + [Severity.WARN]
    stuck = steps[-1]["gpu/0"]
    assert stuck.evidence["since"] == h.node.start_wall + 60 and "for 60 s" in stuck.message


def test_a_gap_in_the_samples_or_a_new_workload_starts_the_run_again() -> None:
    run = Run()
    assert [run.step(t, True, [1], 30.0) for t in (0, 10, 20)] == [0, 10, 20]
    assert run.step(70, True, [1], 30.0) == 0  # 50 s unobserved: nobody saw it hold
    assert run.step(80, True, [1, 2], 30.0) == 10  # a process joins the same run
    assert run.step(90, True, [9], 30.0) == 0  # none of the run's processes left: another workload
    assert run.step(85, True, [9], 30.0) == 0  # the clock stepped back
    assert run.step(95, True, None, 30.0) == 10  # processes not listable: judged without them
    assert run.step(105, False, [9], 30.0) == 0 and run.since is None


def test_an_unsupported_pcie_reading_is_judged_without_it_and_said(sim: Any) -> None:
    h = sim(_scenario(f"at_s: 0, gpu: 0, {HUNG}",
                      "at_s: 0, kind: compute_process, gpu: 0, pid: 7",
                      "at_s: 0, kind: nvml_error, gpu: 0, function: nvmlDeviceGetPcieThroughput, "
                      "error: not_supported", gpus=1))
    stuck = _Daemon(h).walk(60)[-1]["gpu/0"]
    assert stuck.severity is Severity.WARN and "PCIe n/a MB/s for 60 s" in stuck.message
    assert any("PCIe throughput" in note for note in stuck.evidence["not_judged"])


def test_config_defaults_are_sicheks_rule() -> None:
    c = CollectiveHangConfig()
    assert (c.min_utilization_pct, c.max_power_w, c.max_memory_utilization_pct, c.max_pcie_mbps,
            c.hold_s) == (95, 100, 5, 300, 60)


@pytest.mark.parametrize("sku, watts", [("h100-sxm", 160), ("h200-sxm", 160), ("a100-sxm-80gb", 100),
                                        ("b200", 230)])
def test_the_power_ceiling_follows_the_sku_profile(sim: Any, sku: str, watts: float) -> None:
    h = sim(f"name: t\nsku: {sku}\ngpus: 1\n")
    options = h.context(CollectiveHangCheck, 0.0).options
    assert isinstance(options, CollectiveHangConfig) and options.max_power_w == watts


def test_the_run_survives_a_daemon_restart_through_the_saved_state(sim: Any) -> None:
    h = sim(_scenario(f"at_s: 0, gpu: 0, {HUNG}",
                      "at_s: 0, kind: compute_process, gpu: 0, pid: 7", gpus=1))
    d = _Daemon(h)
    d.walk(30)
    saved = json.loads(json.dumps(h.states["collective_hang"]))  # what <state_dir>/checks/ holds
    assert saved["gpus"]["0"]["since"] == h.node.start_wall
    d.check = CollectiveHangCheck()  # a new daemon process: the state read back from disk
    d.ctx.state = saved
    h.states["collective_hang"] = saved
    found = [d.step(t) for t in (40, 50, 60)]
    assert [f["gpu/0"].severity for f in found] == [Severity.OK, Severity.OK, Severity.WARN]
    assert found[-1]["gpu/0"].evidence["since"] == h.node.start_wall
    # state of another shape (an older release, a hand edit) is set aside, never raised on
    d.check = CollectiveHangCheck()
    d.ctx.state = {"boot_id": 3, "gpus": {"0": {"since": "yesterday"}}}
    h.states["collective_hang"] = d.ctx.state
    again = d.step(70)["gpu/0"]
    assert again.severity is Severity.OK and again.evidence["held_s"] == 0
