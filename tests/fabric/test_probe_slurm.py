"""``srun -N 3 gpumon probe-fabric`` on a real Slurm cluster whose nodes are test hosts in network
namespaces (one slurmd each, its own host name): the probe spans three Slurm nodes, finds the rendezvous
host through ``scontrol``, names the slow node, and that node's own gpumon daemon drains it in Slurm
with gpumon's reason.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

from .probe_run import GPUMON, node_config, rank_env, stop
from .slurm_cluster import SlurmCluster


def _probe(cluster: SlurmCluster, base: Path, timeout: float = 120) -> tuple[dict[str, Any], str]:
    # every node reads its own config, as /etc/gpumon/gpumon.yaml would be on a real cluster
    node = f'{base}/"$SLURMD_NODENAME"'
    script = (f"exec {GPUMON} probe-fabric --json --device cpu --config {node}/gpumon.yaml "
              f"--simulate healthy-8xh100 --sim-dir {node}/sim")
    proc = cluster.srun(["/bin/sh", "-c", script], nodes=3, ntasks_per_node=1,
                        env={"GLOO_SOCKET_IFNAME": "eth0", "PYTHONUNBUFFERED": "1"}, timeout=timeout)
    try:
        return dict(json.loads(proc.stdout)), proc.stderr
    except ValueError:
        raise AssertionError(f"no JSON report from srun (rc {proc.returncode}):\n{proc.stdout}\n"
                             f"{proc.stderr[-4000:]}\n{cluster.logs()[-2000:]}") from None


def test_srun_spans_three_slurm_nodes_names_the_slow_one_and_its_daemon_drains_it(
        slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    cluster = slurm_cluster
    base = tmp_path
    for h in cluster.net.hosts:
        node_config(base, h.name, collectives=["all_reduce", "alltoall"])
    healthy, _ = _probe(cluster, base)
    assert healthy["launch"]["launcher"] == "slurm" and healthy["launch"]["world"] == 3, healthy["launch"]
    assert sorted(healthy["nodes"]) == ["node0", "node1", "node2"]
    assert healthy["status"] == "ok", healthy["findings"]

    cluster.net.shape(1, rate="200mbit")
    try:
        report, err = _probe(cluster, base)
    finally:
        cluster.net.unshape(1)
    verdicts = {n: (f["severity"], f["action"]) for n, f in report["findings"].items()}
    assert verdicts == {"node0": ("ok", "none"), "node1": ("fail", "check_cables"),
                        "node2": ("ok", "none")}, (verdicts, err[-3000:])
    latest = json.loads((base / "node1" / "sim" / "state" / "fabric" / "latest.json").read_text())
    assert latest["finding"]["severity"] == "fail"

    # node1's own daemon (remediation: Slurm, enforce) drains node1 with gpumon's reason
    cfg = node_config(base, "node1-daemon")
    cfg.write_text(cfg.read_text().replace("node_name: node1-daemon", "node_name: node1")
                   + "exporter:\n  enabled: false\nremediation:\n  backend: slurm\n  mode: enforce\n"
                   "  interval_s: 1\n  slurm:\n    node_name: node1\n")
    daemon = cluster.net.popen_ns(
        cluster.net.switch_ns,
        [GPUMON, "daemon", "--simulate", "healthy-8xh100", "--sim-dir", str(base / "node1" / "sim"),
         "--config", str(cfg), "--duration", "60"],
        env={**rank_env(), **cluster.env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 45
        reasons: dict[str, tuple[str, str]] = {}
        while time.monotonic() < deadline:
            reasons = cluster.sinfo_reasons()
            if "node1" in reasons:
                break
            time.sleep(0.5)
        assert "node1" in reasons, f"node1 not drained: {reasons}"
        _state, reason = reasons["node1"]
        assert reason.startswith("gpumon: check_cables"), reasons
        assert "node0" not in reasons and "node2" not in reasons
    finally:
        stop(daemon)
        cluster.resume("node1")
