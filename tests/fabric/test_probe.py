"""``gpumon probe-fabric`` for real: gloo ranks on test hosts in network namespaces, started by torchrun,
by the env:// protocol Kubernetes and MPI launches use, and by Slurm's srun across slurmd nodes.

Faults are real too: ``tc tbf`` makes one host slow, ``ip link set down`` cuts one mid-sweep, and the
fault-injection harness of the SDC canaries corrupts one rank's contributions (tests/fabric/faulty_rank.py
wraps the real CLI; nothing in gpumon knows it is under test). No mock of torch.distributed or of a
launcher anywhere.
"""

from __future__ import annotations

import itertools
import json
import sqlite3
import subprocess
import time
from pathlib import Path
from typing import Any

from .netns import TestNet
from .probe_run import (
    FAULTY_RANK,
    GPUMON,
    ProbeRun,
    node_config,
    rank_env,
    start_static,
    start_torchrun,
    stop,
)

_ports = itertools.count(29810)


def _port() -> int:
    return next(_ports)


def _verdicts(report: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {n: (f["severity"], f["action"]) for n, f in report["findings"].items()}


def _health_faults(state: Path) -> list[tuple[str, str]]:
    """The fabric findings stored in a node's health store (the events the daemon folds)."""
    with sqlite3.connect(state / "health.db") as db:
        rows = db.execute("SELECT payload FROM events WHERE check_name = 'fabric' ORDER BY id").fetchall()
    out = []
    for (payload,) in rows:
        f = json.loads(payload)
        if "severity" in f:
            out.append((f["severity"], f.get("action", "none")))
    return out


def _no_leftovers(net: TestNet) -> None:
    deadline = time.monotonic() + 5
    while net.pids() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert net.pids() == [], f"processes left in the test hosts: {net.pids()}"


def test_torchrun_across_two_hosts_passes_and_records_every_node(testnet: Any, tmp_path: Path) -> None:
    """One torchrun per host, c10d rendezvous: the group report on rank 0, every node's own verdict in
    its own state directory, nothing left running."""
    net = testnet(2)
    run = start_torchrun(net, tmp_path, _port())
    run.wait(120)
    assert run.codes == {0: 0, 1: 0}, run.logs()
    report = run.report()
    assert report["outcome"] == "completed" and report["status"] == "ok", report
    assert report["launch"]["launcher"] == "torchrun"
    assert set(report["nodes"]) == {"node0", "node1"}
    ops = {row["op"] for row in report["collectives"]}
    assert ops == {"all_reduce", "all_gather", "reduce_scatter", "alltoall"}
    sizes = sorted({row["nbytes"] for row in report["collectives"] if row["op"] == "all_reduce"})
    assert sizes[0] <= 16 and sizes[-1] == 1 << 20, sizes
    assert all(row["wrong"] == 0 and row["iterations"] >= 3 for row in report["collectives"])
    assert all(row["busbw_gbps"] > 0 for row in report["collectives"] if row["nbytes"] >= 1 << 16)
    for i in (0, 1):
        latest = run.latest(i)
        assert latest["node"] == f"node{i}" and latest["finding"]["severity"] == "ok", latest
        names = {r[0] for r in latest["finding"]["evidence"]["readings"]}
        assert {"fabric_busbw_bytes_per_second", "fabric_latency_p95_seconds",
                "fabric_last_probe_timestamp_seconds", "fabric_last_probe_passed"} <= names
        assert _health_faults(run.state(i)) == [("ok", "none")]
    assert (run.state(0) / "fabric" / "group-latest.json").is_file()
    _no_leftovers(net)


def test_a_slow_host_and_only_it_is_named_two_runs_of_two(testnet: Any, tmp_path: Path) -> None:
    """tbf at 200 Mbit/s on host 2 of 4: each run names node2 a node fault (check_cables), and no other
    node. The collectives are limited to all_reduce here: the pair rounds are what names a node. Two
    runs (two pairing seeds) in the suite; repeatability over many runs is bench/fabric_isolation.py's."""
    net = testnet(4)
    net.shape(2, rate="200mbit")
    for attempt in range(2):
        base = tmp_path / f"run{attempt}"
        run = start_static(net, base, _port(), collectives=["all_reduce"])
        run.wait(120)
        report = run.report()
        verdicts = _verdicts(report)
        assert verdicts["node2"] == ("fail", "check_cables"), (attempt, report["findings"]["node2"],
                                                               run.logs())
        # a healthy node named: its whole finding and the pairs, to tell noise from a real fault
        others = {n: report["findings"][n] for n, v in verdicts.items()
                  if n != "node2" and v != ("ok", "none")}
        assert not others, (attempt, others, report["isolation"], run.logs())
        fault = report["findings"]["node2"]["evidence"]["node_fault"]
        assert len(fault["slow_partners"]) >= 2 and fault["kinds"], fault
        assert run.codes[0] == 2 and all(run.codes[i] == 0 for i in (1, 2, 3)), run.codes
        assert report["isolation"]["node_faults"].keys() == {"node2"}
        assert run.latest(2)["finding"]["severity"] == "fail"
    _no_leftovers(net)


def test_a_link_cut_mid_sweep_ends_by_the_deadline_naming_the_lost_host(testnet: Any, tmp_path: Path) -> None:
    net = testnet(4)
    deadline = 25.0
    run = start_static(net, tmp_path, _port(), deadline_s=deadline)
    # cut as the second collective of the sweep starts (a loaded machine may take a while to get there)
    assert run.wait_for(0, "rank 0: all_gather", deadline - 5), run.stderr(0)
    net.link_down(2)
    run.wait(deadline + 30)
    ended = max(run.ended.values()) - run.started
    assert ended <= deadline + 5, f"the probe took {ended:.1f} s, deadline {deadline} s\n{run.logs()}"
    assert None not in run.codes.values(), run.codes
    report = run.report()
    assert report["outcome"] == "incomplete" and report["status"] == "fail", report
    assert {v["node"] for v in report["lost"].values()} == {"node2"}, report["lost"]
    assert _verdicts(report)["node2"] == ("fail", "check_cables")
    assert all(v[0] == "unknown" for n, v in _verdicts(report).items() if n != "node2")
    # the host that was cut off could not learn the verdict: it says so in its own state
    cut_off = run.latest(2)["finding"]
    assert cut_off["severity"] == "unknown" and "lost the group" in cut_off["message"], cut_off
    _no_leftovers(net)


def test_a_corrupted_contribution_names_its_rank_and_node(testnet: Any, tmp_path: Path) -> None:
    """Rank 1's outgoing data gets flipped bits (the SDC fault harness, on the collectives it calls):
    the report names rank 1 on node1, fail/inspect_hardware; the other nodes stay ok."""
    net = testnet(3)
    spec = ("worker=1,dtype=fp32,rate=1.0,where=input,ops=allreduce_|_allgather_base_|alltoall_base_|send,"
            "seed=3")
    run = start_static(net, tmp_path, _port(), wrapper=[str(Path(GPUMON).with_name("python")), FAULTY_RANK],
                       env={"GPUMON_TEST_FAULT": spec}, collectives=["all_reduce", "alltoall"])
    run.wait(120)
    report = run.report()
    verdicts = _verdicts(report)
    assert verdicts["node1"] == ("fail", "inspect_hardware"), (report["findings"]["node1"], run.logs())
    assert verdicts["node0"] == ("ok", "none") and verdicts["node2"] == ("ok", "none"), verdicts
    assert set(report["corrupted_from_ranks"]) == {"1"}, report["corrupted_from_ranks"]
    assert report["corrupted_from_ranks"]["1"]["node"] == "node1"
    assert "rank(s) 1 on node1" in report["findings"]["node1"]["message"]
    assert run.codes[0] == 2
    _no_leftovers(net)


def test_findings_reach_health_state_and_metrics_and_a_passing_probe_clears_them(
        testnet: Any, tmp_path: Path) -> None:
    """Each node runs the probe as a simulated GPU node (--simulate: its NVML is the injection library,
    so the idle gate reads real NVML calls), recording into that node's state. The daemon of the slow
    node then exports the fault; after the link is fixed a passing probe clears it."""
    net = testnet(4)
    net.shape(3, rate="200mbit")
    sims = {i: tmp_path / f"sim{i}" for i in range(4)}

    # --sim-dir per host: each node keeps its simulated host tree and state
    run = start_static(net, tmp_path / "first", _port(), sim_dirs=sims, collectives=["all_reduce"])
    run.wait(120)
    assert _verdicts(run.report())["node3"] == ("fail", "check_cables"), run.logs()
    assert (sims[3] / "state" / "fabric" / "latest.json").is_file()
    metrics = _daemon_metrics(sims[3], run.config(3))
    assert 'gpumon_finding_severity{check="fabric",component="node"} 4.0' in metrics, metrics[-3000:]
    assert 'gpumon_recommended_action{action="check_cables",component="node"} 1.0' in metrics
    assert ('gpumon_fabric_busbw_bytes_per_second{check="fabric",component="node",op="sendrecv",'
            'size_class="large"}') in metrics
    assert "gpumon_fabric_last_probe_passed" in metrics
    # issue 35: the group's pair coverage (four nodes: every pair in this run)
    for family, value in (("pairs_measured", 6), ("pairs_in_group", 6), ("runs_since_full_coverage", 0),
                          ("runs_per_coverage_cycle", 1)):
        assert f'gpumon_fabric_{family}{{check="fabric",component="node"}} {value:.1f}' in metrics, family

    net.unshape(3)
    again = start_static(net, tmp_path / "second", _port(), sim_dirs=sims, collectives=["all_reduce"])
    again.wait(120)
    assert all(v == ("ok", "none") for v in _verdicts(again.report()).values()), again.logs()
    metrics = _daemon_metrics(sims[3], again.config(3))
    assert 'gpumon_finding_severity{check="fabric",component="node"} 0.0' in metrics, metrics[-3000:]
    assert 'gpumon_health_state{component="node",state="healthy"} 1.0' in metrics
    _no_leftovers(net)


def _daemon_metrics(sim_dir: Path, config: Path) -> str:
    """Start the node's daemon on its simulated node, scrape /metrics once the fabric check has run."""
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([GPUMON, "daemon", "--simulate", "healthy-8xh100", "--sim-dir", str(sim_dir),
                             "--config", str(config), "--listen", f"127.0.0.1:{port}", "--duration", "60"],
                            env=rank_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 45
        text = ""
        while time.monotonic() < deadline:
            time.sleep(0.5)
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
                    text = resp.read().decode()
            except OSError:
                continue
            if 'check="fabric"' in text and "gpumon_health_state" in text:
                return text
        raise AssertionError(f"no fabric metrics within 45 s:\n{text[-2000:]}")
    finally:
        stop(proc)


def test_not_started_by_a_launcher_is_exit_3_with_the_reason(tmp_path: Path) -> None:
    cfg = node_config(tmp_path, "lonely")
    proc = subprocess.run([GPUMON, "probe-fabric", "--config", str(cfg)], env=rank_env(), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 3, proc
    assert "not started by a launcher" in proc.stderr


def _launch_env(kind: str, i: int, world: int, master: str, port: int) -> dict[str, str]:
    """What Open MPI's mpirun (with -x MASTER_ADDR/MASTER_PORT) or a Kubernetes Indexed Job (one rank
    per pod) put in a rank's environment."""
    if kind == "openmpi":
        return rank_env(OMPI_COMM_WORLD_RANK=str(i), OMPI_COMM_WORLD_SIZE=str(world),
                        OMPI_COMM_WORLD_LOCAL_RANK="0", OMPI_COMM_WORLD_LOCAL_SIZE="1",
                        MASTER_ADDR=master, MASTER_PORT=str(port))
    return rank_env(JOB_COMPLETION_INDEX=str(i), GPUMON_FABRIC_WORLD_SIZE=str(world), MASTER_ADDR=master,
                    MASTER_PORT=str(port))


def test_openmpi_and_kubernetes_environments_launch_a_group(testnet: Any, tmp_path: Path) -> None:
    net = testnet(2)
    for kind in ("openmpi", "kubernetes"):
        run = ProbeRun(net, tmp_path / kind)
        for h in net.hosts:
            node_config(run.base, h.name, collectives=["all_reduce"])
        port = _port()
        run.started = time.monotonic()
        for h in net.hosts:
            run.procs[h.index] = run.popen(h.index, [GPUMON, "probe-fabric", "--json", "--device", "cpu",
                                                     "--config", str(run.config(h.index))],
                                           _launch_env(kind, h.index, 2, net.hosts[0].ip, port))
        run.wait(120)
        report = run.report()
        assert report["launch"]["launcher"] == kind and report["status"] == "ok", (kind, run.logs())
        assert run.codes == {0: 0, 1: 0}
    _no_leftovers(net)


def test_a_busy_node_keeps_the_whole_group_from_probing(testnet: Any, tmp_path: Path) -> None:
    """The idle gate of the SDC canaries, through NVML (the injection library of a simulated node): a
    compute process on host 1's GPU 0 and no rank measures anything, nothing is recorded, exit 0."""
    net = testnet(2)
    busy = tmp_path / "busy.yaml"
    busy.write_text("name: busy-8xh100\nsku: h100-sxm\ngpus: 8\nfaults:\n"
                    "  - {at_s: 0, kind: compute_process, gpu: 0, pid: 4242, memory_mib: 20000}\n")
    run = ProbeRun(net, tmp_path / "probe")
    for h in net.hosts:
        node_config(run.base, h.name)
    port = _port()
    run.started = time.monotonic()
    for h in net.hosts:
        scenario = str(busy) if h.index == 1 else "healthy-8xh100"
        env = rank_env(RANK=str(h.index), WORLD_SIZE="2", MASTER_ADDR=net.hosts[0].ip, MASTER_PORT=str(port))
        run.procs[h.index] = run.popen(h.index, [GPUMON, "probe-fabric", "--json", "--config",
                                                 str(run.config(h.index)), "--simulate", scenario,
                                                 "--sim-dir", str(tmp_path / f"sim{h.index}")], env)
    run.wait(120)
    report = run.report()
    assert report["outcome"] == "skipped" and report["status"] == "ok", (report, run.logs())
    assert "node1" in report["reason"] and "4242" in report["reason"]
    assert run.codes == {0: 0, 1: 0}
    assert not any((tmp_path / f"sim{i}" / "state" / "fabric" / "latest.json").exists() for i in (0, 1))
    _no_leftovers(net)
