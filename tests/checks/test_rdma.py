"""The rdma check on a simulated HGX H100 node (8 GPUs, 8 NDR NICs, each pair on one PCIe switch).

ib_write_bw is a small real executable on a temporary PATH (handed to the check through the
ToolRunner's search_path): it replays a capture of perftest's output (tests/data/perftest, provenance
in its SOURCES.md), chosen by the device and --use_cuda it is given. Where a test needs an 8 MiB
result the capture does not hold, the replay is the real capture's header and column layout with the
result row replaced, and the test says so. The server half prints nothing; the client half prints
the capture.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from fake_tools import POST_LIST, fake_perftest, replay_with_row
from prometheus_client import generate_latest

from gpumon.check import RetryRequest
from gpumon.export.prometheus import Snapshot, SnapshotHolder, make_registry
from gpumon.hw.perftest import LoopbackRun, LoopbackSpec, parse_bw
from gpumon.hw.tools import ToolRunner
from gpumon.model import Action, CheckRun, Finding, Severity
from gpumon_checks.rdma import RdmaCheck, RdmaConfig, _Target, waves


def run(sim: Callable[..., Any], tmp_path: Path, bin_dir: Path | None, scenario: str = "", *,
        options: RdmaConfig | None = None, retry: RetryRequest | None = None) -> list[Finding]:
    h = sim(scenario or "name: rdma\nsku: h100-sxm\n")
    ctx = h.context(RdmaCheck, 0.0)
    ctx.hw.tools = ToolRunner(30, search_path=str(bin_dir if bin_dir else tmp_path / "empty"))
    # host loopbacks one after another is the default (see test_host_loopbacks_run_one_after_another);
    # the replays do not share a real host's memory, so the other tests run them at once
    ctx.options = options or RdmaConfig(parallel_host=True)
    ctx.retry = retry
    assert RdmaCheck().supported(ctx.inventory) is None
    return RdmaCheck().run(ctx)


def by(findings: list[Finding]) -> dict[str, list[Finding]]:
    out: dict[str, list[Finding]] = {}
    for f in findings:
        out.setdefault(f.component, []).append(f)
    return out


def test_healthy_node_host_and_gpudirect_loopback(sim: Callable[..., Any], tmp_path: Path) -> None:
    bin_dir, log = fake_perftest(tmp_path, {"default": replay_with_row(392.11)})
    findings = run(sim, tmp_path, bin_dir)
    assert {f.severity for f in findings} == {Severity.OK}, [f.message for f in findings if f.severity]
    comps = by(findings)
    assert sorted(c for c in comps if c.startswith("ib/")) == [f"ib/mlx5_{i}/1" for i in range(8)]
    assert sorted(c for c in comps if c.startswith("gpu/")) == [f"gpu/{i}" for i in range(8)]
    [host] = comps["ib/mlx5_3/1"]
    assert host.message == "mlx5_3 port 1 host-memory loopback: 392.1 Gb/s (threshold 360)"
    assert host.evidence["retryable"] is True and host.evidence["retry_id"] == "host"
    assert (host.evidence["threshold_gbps"], host.evidence["expected_gbps"], host.evidence["efficiency"]) == (
        360.0, 400.0, 0.9)
    assert host.evidence["threshold_from"].startswith("profile h100-sxm network.ib_rate_gbps")
    [gdr] = comps["gpu/3"]
    assert gdr.message == "GPUDirect RDMA gpu/3 <-> mlx5_3 port 1: 392.1 Gb/s (threshold 380)"
    assert (gdr.evidence["retry_id"], gdr.evidence["device"], gdr.evidence["switch"]) == (
        "gdr:mlx5_3", "mlx5_3", "0000:5a:00.0")
    # on /metrics in bytes per second (perftest's Gbit/s x 1.25e8), naming the NIC and its port
    assert host.evidence["readings"] == [["rdma_loopback_bytes_per_second", 392.11 * 1.25e8,
                                          {"kind": "host", "device": "mlx5_3", "port": "1"}]]
    assert gdr.evidence["readings"] == [["rdma_loopback_bytes_per_second", 392.11 * 1.25e8,
                                         {"kind": "gdr", "device": "mlx5_3", "port": "1"}]]
    lines = log.read_text().splitlines()
    # server and client of each of 16 runs, the CUDA index in NVML's (PCI bus) order
    assert len([ln for ln in lines if ln.endswith("localhost")]) == 16
    assert ("PCI_BUS_ID -d mlx5_3 -i 1 -p 18518 -s 8388608 -n 5000 -q 1 -F --report_gbits localhost" in lines)
    assert ("PCI_BUS_ID -d mlx5_3 -i 1 -p 18526 -s 8388608 -n 5000 -q 1 -F --report_gbits --use_cuda=3 "
            "localhost" in lines)


def test_a_nic_below_rate_fails_on_its_port(sim: Callable[..., Any], tmp_path: Path) -> None:
    bin_dir, _ = fake_perftest(tmp_path, {"default": replay_with_row(392.0), "mlx5_3": replay_with_row(301.5),
                                          "mlx5_5-gpu5": replay_with_row(350.0)})
    findings = run(sim, tmp_path, bin_dir)
    bad = [f for f in findings if f.severity is not Severity.OK]
    assert [(f.component, f.severity, f.action) for f in bad] == [
        ("ib/mlx5_3/1", Severity.FAIL, Action.INSPECT_HARDWARE),
        ("gpu/5", Severity.FAIL, Action.INSPECT_HARDWARE)]
    assert bad[0].message == ("mlx5_3 port 1 host-memory loopback: 301.5 Gb/s, below 360 Gb/s (90% of 400): "
                              "the NIC or its PCIe path is slow")
    assert bad[1].message.startswith("GPUDirect RDMA gpu/5 <-> mlx5_5 port 1: 350.0 Gb/s, below 380 Gb/s "
                                     "(95% of")
    assert all(f.evidence["retryable"] is True for f in bad)


def test_real_capture_replayed_is_far_below_rate(sim: Callable[..., Any], tmp_path: Path) -> None:
    # the real 8-byte post-list run (0.48 Gb/s): no 8 MiB row, so its largest row is judged and said so
    bin_dir, _ = fake_perftest(tmp_path, {"default": POST_LIST})
    findings = run(sim, tmp_path, bin_dir, options=RdmaConfig(gdr=False, parallel_host=True))
    assert len(findings) == 8 and {f.severity for f in findings} == {Severity.FAIL}
    f = findings[0]
    assert f.evidence["measured_gbps"] == 0.48 and f.evidence["link_type"] == "Ethernet"
    assert f.evidence["size_note"] == "no 8388608-byte row in the output; judged the largest (8 bytes)"


def test_perftest_error_is_unknown_with_its_words(sim: Callable[..., Any], tmp_path: Path) -> None:
    bin_dir, _ = fake_perftest(tmp_path, {})  # no output file: the replay prints perftest's MR error
    findings = run(sim, tmp_path, bin_dir, options=RdmaConfig(gdr=False, parallel_host=True))
    assert {f.severity for f in findings} == {Severity.UNKNOWN}
    assert findings[0].message == ("mlx5_0 port 1 host-memory loopback: no bandwidth result (exit 1: no "
                                   "bandwidth table in the output (no '#bytes' header) (stderr: Couldn't "
                                   "allocate MR))")


def test_host_loopbacks_run_one_after_another(sim: Callable[..., Any], tmp_path: Path) -> None:
    bin_dir, log = fake_perftest(tmp_path, {"default": replay_with_row(392.0)})
    h = sim("name: three\nsku: h100-sxm\nib_devices: 3\ngpus: 3\n")
    ctx = h.context(RdmaCheck, 0.0)
    ctx.hw.tools = ToolRunner(30, search_path=str(bin_dir))
    findings = RdmaCheck().run(ctx)  # the default configuration
    assert len(findings) == 6 and {f.severity for f in findings} == {Severity.OK}
    lines = log.read_text().splitlines()
    host = [ln for ln in lines if "--use_cuda" not in ln]
    # each NIC's server and client before the next NIC's: never two host loopbacks at once
    assert [(ln.split()[2], ln.endswith("localhost")) for ln in host] == [
        (f"mlx5_{i}", client) for i in range(3) for client in (False, True)]


def test_gpudirect_waves_never_share_a_nic_or_a_gpu() -> None:
    def target(device: str, cuda: int) -> _Target:
        spec = LoopbackSpec(device, cuda=cuda)
        return _Target(f"gpu/{cuda}", f"gdr:{device}", spec, 400.0, "", 0.95, "", {})

    # two GPUs and two NICs per switch: each NIC pairs with both GPUs
    t = [target("mlx5_0", 0), target("mlx5_1", 0), target("mlx5_0", 1), target("mlx5_1", 1)]
    assert waves(t) == [[t[0], t[3]], [t[1], t[2]]]


def test_two_nics_on_one_gpus_switch_are_two_series_on_metrics() -> None:
    # a GPU that pairs with two NICs (two GPUs and two NICs per switch): both gdr findings are on the
    # GPU's component, so only the device and port labels keep the exporter from dropping one
    findings = []
    for device, gbits in (("mlx5_0", 392.0), ("mlx5_1", 301.5)):
        spec = LoopbackSpec(device, cuda=0)
        target = _Target("gpu/0", f"gdr:{device}", spec, 400.0, "", 0.95, f"gpu/0 <-> {device}", {})
        findings.append(RdmaCheck()._judge(target, LoopbackRun(spec, parse_bw(replay_with_row(gbits)))))
    snap = Snapshot("n", "p", "v", {"rdma": CheckRun("rdma", findings, 0.0, 1.0, "completed")})
    text = generate_latest(make_registry(SnapshotHolder(snap))).decode()
    series = sorted(line for line in text.splitlines() if line.startswith("gpumon_rdma_loopback"))
    assert series == [
        'gpumon_rdma_loopback_bytes_per_second{check="rdma",component="gpu/0",device="mlx5_0",kind="gdr",'
        'port="1"} 4.9e+10',
        'gpumon_rdma_loopback_bytes_per_second{check="rdma",component="gpu/0",device="mlx5_1",kind="gdr",'
        'port="1"} 3.76875e+10']


def test_client_is_retried_until_the_server_listens(sim: Callable[..., Any], tmp_path: Path) -> None:
    bin_dir, log = fake_perftest(tmp_path, {"default": replay_with_row(395.0)}, refuse_first=True)
    h = sim("name: one\nsku: h100-sxm\nib_devices: 1\ngpus: 1\n")
    ctx = h.context(RdmaCheck, 0.0)
    ctx.hw.tools = ToolRunner(30, search_path=str(bin_dir))
    ctx.options = RdmaConfig(gdr=False)
    [f] = RdmaCheck().run(ctx)
    assert f.severity is Severity.OK
    assert len([ln for ln in log.read_text().splitlines() if ln.endswith("localhost")]) == 2


def test_a_hung_run_fails(sim: Callable[..., Any], tmp_path: Path) -> None:
    bin_dir, _ = fake_perftest(tmp_path, {"default": replay_with_row(395.0)}, client_sleep=5)
    h = sim("name: one\nsku: h100-sxm\nib_devices: 1\ngpus: 1\n")
    ctx = h.context(RdmaCheck, 0.0)
    ctx.hw.tools = ToolRunner(30, search_path=str(bin_dir))
    ctx.options = RdmaConfig(gdr=False, run_timeout_s=1.0)
    [f] = RdmaCheck().run(ctx)
    assert (f.component, f.severity) == ("ib/mlx5_0/1", Severity.FAIL)
    assert f.message == "mlx5_0 port 1 host-memory loopback: ib_write_bw did not finish within 1 s (killed)"


def test_retry_measures_only_the_measurements_named(sim: Callable[..., Any], tmp_path: Path) -> None:
    bin_dir, log = fake_perftest(tmp_path, {"default": replay_with_row(392.0)})
    retry = RetryRequest(2, ("gpu/5", "ib/mlx5_3/1"),
                         frozenset({("ib/mlx5_3/1", "host"), ("gpu/5", "gdr:mlx5_5")}))
    findings = run(sim, tmp_path, bin_dir, retry=retry)
    assert [(f.component, f.evidence["retry_id"]) for f in findings] == [("ib/mlx5_3/1", "host"),
                                                                         ("gpu/5", "gdr:mlx5_5")]
    clients = [ln for ln in log.read_text().splitlines() if ln.endswith("localhost")]
    assert len(clients) == 2  # the two run in parallel: their lines come in either order
    assert any("-d mlx5_3 " in c and "--use_cuda" not in c for c in clients)
    assert any("-d mlx5_5 " in c and "--use_cuda=5" in c for c in clients)


def test_a_port_that_is_down_fails_and_is_not_measured(sim: Callable[..., Any], tmp_path: Path) -> None:
    bin_dir, log = fake_perftest(tmp_path, {"default": replay_with_row(392.0)})
    findings = run(sim, tmp_path, bin_dir, "name: down\nsku: h100-sxm\nfaults:\n"
                   "  - {at_s: 0, kind: ib_down, device: mlx5_2, port: 1}\n")
    comps = by(findings)
    [down] = comps["ib/mlx5_2/1"]
    assert (down.severity, down.action) == (Severity.FAIL, Action.CHECK_CABLES)
    assert down.message == "mlx5_2 port 1 is not up (1: DOWN, 2: Polling): bandwidth cannot be measured"
    assert "gpu/2" not in comps  # its NIC cannot be measured, so neither can its GPUDirect path
    assert "-d mlx5_2" not in log.read_text()


def test_perftest_without_cuda_skips_gpudirect(sim: Callable[..., Any], tmp_path: Path) -> None:
    bin_dir, _ = fake_perftest(tmp_path, {"default": replay_with_row(392.0)}, cuda=False)
    findings = run(sim, tmp_path, bin_dir)
    skipped = [f for f in findings if f.severity is Severity.SKIPPED]
    assert [f.message for f in skipped] == ["this ib_write_bw was built without CUDA (its usage text lists "
                                            "no --use_cuda): GPUDirect RDMA loopback not measured"]
    assert len([f for f in findings if f.severity is Severity.OK]) == 8


def test_no_perftest_is_skipped_with_the_reason(sim: Callable[..., Any], tmp_path: Path) -> None:
    [f] = run(sim, tmp_path, None)
    assert (f.component, f.severity) == ("node", Severity.SKIPPED)
    assert f.message == ("perftest's ib_write_bw is not installed (not found on PATH): RDMA bandwidth not "
                         "measured")


def test_no_rdma_device_is_not_supported(sim: Callable[..., Any]) -> None:
    h = sim("name: none\nsku: h100-sxm\nib_devices: 0\n")
    ctx = h.context(RdmaCheck, 0.0)
    assert RdmaCheck().supported(ctx.inventory) == "no RDMA device under sys/class/infiniband"
